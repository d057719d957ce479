"""An event on its way into the `events` table: its row, the statements that store a batch of
rows whole (COPY on PostgreSQL, staging and INSERT ... ON CONFLICT elsewhere or for repeats), and
the lookup of those stored already."""

import json
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import orjson
from sqlalchemy import select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from service.models import JobEvent


class EventRow(NamedTuple):
    """An event as stored: the columns of `events` (JobEvent), `data` as JSON text."""

    job_id: str
    attempt: int
    source: str
    seq: int
    kind: str
    ts: float  # on the service's clock: the emitter's ts plus clock_offset_seconds
    clock_offset_seconds: float
    step: int | None
    duration: float | None  # data.duration of `step` events, summed by the rollback lookup
    data: str


class Pending(NamedTuple):
    """An event of the batch on its way in."""

    row: EventRow
    data: dict[str, Any]  # `data` as stored, decoded (NaN and infinities are null)
    index: int  # in the request, for error messages

    @property
    def key(self) -> tuple[int, str, int]:
        return (self.row.attempt, self.row.source, self.row.seq)

    # What the fold reads (service/accounting/fold.py).
    job_id = property(lambda self: self.row.job_id)
    kind = property(lambda self: self.row.kind)
    ts = property(lambda self: self.row.ts)
    attempt = property(lambda self: self.row.attempt)
    source = property(lambda self: self.row.source)
    step = property(lambda self: self.row.step)


# Each connection stages its batches in a temporary table of the same columns as `events`.
_COLUMNS = ", ".join(EventRow._fields)
_STAGING_DDL = {
    "postgresql": f"CREATE TEMP TABLE IF NOT EXISTS events_in ON COMMIT DELETE ROWS AS SELECT {_COLUMNS} "
    "FROM events WITH NO DATA",
    "sqlite": f"CREATE TEMP TABLE IF NOT EXISTS events_in AS SELECT {_COLUMNS} FROM events WHERE 0",
}


# WHERE true: SQLite would read the ON of ON CONFLICT as a join's otherwise.
_MOVE = (
    f"INSERT INTO events ({_COLUMNS}) SELECT {_COLUMNS} FROM events_in WHERE true ON CONFLICT DO NOTHING "
    "RETURNING job_id, attempt, source, seq"
)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity (PostgreSQL refuses them): a diverged loss is stored as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def encode_data(data: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """`data` as stored, and its JSON: encoded once, for the size limit and the column."""
    try:
        encoded = orjson.dumps(data)
    except orjson.JSONEncodeError:  # an integer over 64 bits, or nesting deeper than orjson goes
        data = _finite(data)
        return data, json.dumps(data, separators=(",", ":")).encode()
    # orjson writes NaN and infinities as null: where the JSON has a null, read the stored form back.
    return (orjson.loads(encoded) if b"null" in encoded else data), encoded


def chunks(keys: list, size: int = 500) -> Iterator[list]:
    """Keys a few hundred at a time: one IN (...) per chunk keeps each statement's parameters bounded."""
    return (keys[start : start + size] for start in range(0, len(keys), size))


def stored_events(session: Session, job_id: str, keys: list[tuple[int, str, int]]) -> dict[tuple, JobEvent]:
    """The job's stored events of these keys (attempt, source, seq), by key."""
    found: dict[tuple, JobEvent] = {}
    for chunk in chunks(keys):
        where = tuple_(JobEvent.attempt, JobEvent.source, JobEvent.seq).in_(chunk)
        for row in session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, where)):
            found[(row.attempt, row.source, row.seq)] = row
    return found


def dialect_insert(session: Session):
    return (postgresql if session.get_bind().dialect.name == "postgresql" else sqlite).insert


def store_new(session: Session, rows: list[EventRow], copy_in_savepoint: bool) -> set[tuple[str, int, str, int]]:
    """Inserts the rows whose key is not stored yet; returns the keys (job, attempt, source, seq) it stored."""
    connection = session.connection()
    if connection.dialect.name == "postgresql" and copy_in_savepoint and _copy_all_new(connection.connection, rows):
        return {(row.job_id, row.attempt, row.source, row.seq) for row in rows}
    cursor = connection.connection.cursor()  # the driver's, inside the session's transaction
    try:
        cursor.execute(_STAGING_DDL[connection.dialect.name])
        cursor.execute("DELETE FROM events_in")  # an earlier batch of this transaction, or (SQLite) of another
        if connection.dialect.name == "postgresql":
            _copy_into(cursor, "events_in", rows)
        else:
            cursor.executemany(f"INSERT INTO events_in VALUES ({', '.join('?' * len(EventRow._fields))})", rows)
        # On the driver's cursor: a burst's tens of thousands of keys come back as plain tuples.
        cursor.execute(_MOVE)
        return set(cursor.fetchall())
    finally:
        cursor.close()


def _copy_all_new(dbapi_connection: Any, rows: list[EventRow]) -> bool:
    """PostgreSQL: COPY the rows straight into `events`, inside a savepoint; False, with nothing
    stored, if one of them is stored already (an agent repeats a batch only when its answer was
    lost). Against staging them and moving them by INSERT ... ON CONFLICT: 30% less of the
    server's time per row, and no emptying of the staging table at commit (BENCHMARKS.md, "Load")."""
    from psycopg.errors import (
        UniqueViolation,  # the PostgreSQL driver: an optional dependency
    )

    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SAVEPOINT copy_events")
        try:
            _copy_into(cursor, "events", rows)
        except UniqueViolation:
            cursor.execute("ROLLBACK TO SAVEPOINT copy_events")
            return False
        return True  # the savepoint ends with the transaction
    finally:
        cursor.close()


def _copy_into(cursor: Any, table: str, rows: list[EventRow]) -> None:
    """PostgreSQL: the rows into `table` by one COPY on the driver's cursor."""
    with cursor.copy(f"COPY {table} ({_COLUMNS}) FROM STDIN") as copy:
        for row in rows:
            copy.write_row(row)
